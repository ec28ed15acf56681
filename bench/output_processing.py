"""Host cost of turning a step's tokens into RequestOutputs, against output length.

    python bench/output_processing.py [--lengths 64 1000 4000 16000] [--rows 32]

For each length, `rows` sequences are grown to that many output tokens through the
OutputProcessor (the default model's tokenizer, random token ids), then one more step
is timed (median of 20): a cost per token independent of output length stays flat.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from metrale.engine.output_processor import OutputProcessor
from metrale.engine.sampler import SampleResult
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.sequence import Sequence


def step_us(processor: OutputProcessor, seqs: list[Sequence], rng: random.Random) -> float:
    times = []
    for _ in range(20):
        results = [SampleResult(rng.randrange(100, 40000)) for _ in seqs]
        start = time.perf_counter()
        processor.process(seqs, results)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    from transformers import AutoTokenizer

    from metrale.model.default_model import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 1000, 4000, 16000])
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    processor = OutputProcessor(AutoTokenizer.from_pretrained(default_model_dir()), {0}, 1 << 20)
    rng = random.Random(0)
    for n in args.lengths:
        for stop in ((), ("END",)):
            params = SamplingParams(max_tokens=1 << 19, stop=list(stop), ignore_eos=True)
            seqs = [Sequence(f"r{i}", [1, 2], params, None) for i in range(args.rows)]
            for _ in range(n):
                processor.process(seqs, [SampleResult(rng.randrange(100, 40000)) for _ in seqs])
            print(f"{n:6} output tokens, stop strings {list(stop)!s:9}: "
                  f"{step_us(processor, seqs, rng):7.0f} us per step of {args.rows} rows")


if __name__ == "__main__":
    main()
