"""Session 47, device run 2: gpu-check's ttft_512 read 26.4 ms p50 at 661d6cd (run 1) against 14.6 ms at bd02ade's
code on session 37's H100. One arm per fresh process, alternated: `python3 ttft_ab.py ROOT` runs the code under ROOT
(this tree, or .old/ = bd02ade), builds the 8B shape (random weights, as gpu-check does) and prints per round the
streamed TTFT of gpu-check's ttft_512 (10 fresh 512-token prompts) and the same prompt through generate() (no loop
thread, no stream), ms."""
import json, os, random, statistics, sys, time
root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
import torch
from localrun.engine import LLMEngine, SamplingParams
from localrun.bench.gpu_check import FULL, _engine_config, _rand_prompt, ttft
import localrun
assert localrun.__file__.startswith(root), localrun.__file__
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
rng = random.Random(3)
out = {"root": os.path.basename(root) or root, "ttft_p50": [], "generate_ms": []}
for r in range(3):
    out["ttft_p50"].append(round(ttft(eng, FULL)["ttft_ms_p50"], 2))
    ms = []
    for _ in range(8):
        p = _rand_prompt(rng, 512, eng.model_config.vocab_size)
        torch.cuda.synchronize(); t = time.perf_counter()
        eng.generate([p], SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
        ms.append((time.perf_counter() - t) * 1000)
    out["generate_ms"].append(round(statistics.median(ms), 2))
print(json.dumps(out), flush=True)
eng.shutdown()
