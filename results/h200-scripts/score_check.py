"""Session 47 (first GPU run of the native engine's prompt scoring, f12188b/95eea21): the engine's prompt logprobs
on CUDA (bf16, graphs and overlap on, as served) against transformers' teacher-forced log-softmax on the same random
8B-shape weights; then the cost of scoring: a batch of 32 prompts of 512 tokens prefilled with max_tokens=1, with and
without prompt_logprobs, alternated. Writes $OUT/score-check.json."""
import json, os, random, statistics, time
import torch
OUT = os.environ.get("OUT", "/tmp")
from localrun.bench.gpu_check import _hf_model, _rand_prompt
from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.models.shapes import get_shape
T0 = time.time()
DEV = os.environ.get("SCORE_DEVICE", "cuda")  # cpu + a tiny shape: a smoke test of this script
mcfg = get_shape(os.environ.get("SCORE_SHAPE", "llama-3.1-8b"))
hf = _hf_model(1234, mcfg, torch.bfloat16 if DEV == "cuda" else torch.float32, DEV)
state = hf.state_dict()
eng = LLMEngine.from_hf_state(mcfg, state.__getitem__, set(state), EngineConfig(
    device=DEV, dtype="bfloat16" if DEV == "cuda" else "float32", max_model_len=4096,
    **({"gpu_memory_fraction": 0.5} if DEV == "cuda" else {"kv_cache_tokens": 8192, "cuda_graphs": True, "overlap": True})))
res = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "build_s": round(time.time() - T0, 1)}
rng = random.Random(0)
prompts = [_rand_prompt(rng, n, mcfg.vocab_size) for n in (7, 300, 1000)]
other = _rand_prompt(rng, 200, mcfg.vocab_size)
outs = eng.generate(prompts + [other], [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=5)] * 3
                    + [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)])
worst, agree, dec, n_all = 0.0, 0, 0, 0
with torch.inference_mode():
    for p, o in zip(prompts, outs):
        pl = o.prompt_logprobs
        assert len(pl) == len(p) and [t for t, _, _ in pl] == p, "prompt_logprobs tokens"
        lp = torch.log_softmax(hf(torch.tensor([p], device=DEV)).logits[0].float(), -1)
        for j in range(1, len(p)):
            ref = lp[j - 1]
            _, chosen, top = pl[j]
            worst = max(worst, abs(chosen - float(ref[p[j]])), *(abs(v - float(ref[i])) for i, v in top))
            t2 = ref.topk(2)
            if float(t2.values[0] - t2.values[1]) > 0.1:
                dec += 1
                agree += top[0][0] == int(t2.indices[0])
            n_all += 1
res["parity"] = {"positions": n_all, "decisive": dec, "decisive_top1_agreement": agree / max(dec, 1),
                 "max_abs_logprob_diff": worst, "passed": agree == dec and worst <= 0.1,
                 "other_stream_tokens": len(outs[3].token_ids)}
print(json.dumps(res), flush=True)
del hf, state
batch = [_rand_prompt(rng, 512, mcfg.vocab_size) for _ in range(32)]
rows = []
for i, scored in enumerate([False, True] * 3):
    sp = SamplingParams(temperature=0, max_tokens=1, **({"prompt_logprobs": 1} if scored else {}))
    b = [[rng.randrange(1000, mcfg.vocab_size)] + q[1:] for q in batch]  # no prefix cache hits between rounds
    DEV == "cuda" and torch.cuda.synchronize(); t = time.perf_counter()
    eng.generate(b, sp)
    DEV == "cuda" and torch.cuda.synchronize()
    rows.append({"scored": scored, "s": round(time.perf_counter() - t, 4)})
    print(json.dumps(rows[-1]), flush=True)
res["score_cost_32x512"] = rows
for k in (False, True):
    res[f"median_s_scored_{k}"] = statistics.median(r["s"] for r in rows[2:] if r["scored"] == k)
res["seconds"] = round(time.time() - T0, 1)
json.dump(res, open(f"{OUT}/score-check.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "score_cost_32x512"}), flush=True)
eng.shutdown()
