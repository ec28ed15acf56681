"""metrale's OpenAI-compatible HTTP server (`metrale serve`).

    engine_api    EngineAPI: all the routes know of an engine (one engine or the cluster)
    async_engine  the LLMEngine on one background thread; asyncio streams per request
    adapter_ops   adapter management as run on the engine thread (incl. draining unloads)
    app           create_app(): routes, error JSON, body limit, /health, /metrics
    openai_api    /v1/completions, /v1/chat/completions, /v1/models
    admin_api     adapter management: vLLM, original-engine and native dialects
    protocol      request bodies -> SamplingParams
    responses     RequestOutputs -> OpenAI bodies and SSE chunks (logprobs included)
    auth, paths   API/admin keys; adapter paths jailed inside --adapter-root
    errors, settings  refusals -> status codes; what the HTTP layer is configured with
    metrics       Prometheus metrics (one registry per server) and landing log lines
    serve, client `metrale serve` and the `metrale adapters` client
"""
