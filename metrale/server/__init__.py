"""metrale's OpenAI-compatible HTTP server (`metrale serve`). The routes (app, openai_api,
admin_api) know an engine only as engine_api.EngineAPI: async_engine.AsyncEngine for one
engine, or the cluster's ingress. Each module's docstring says what it holds.
"""
