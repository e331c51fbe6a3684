"""Native engine parts on tiny models: random-weight Llama (GQA, llama3 rope scaling), Qwen2
(q/k/v bias) and Mistral built with transformers, saved as safetensors and compared token
by token; radix cache, KV pool and sampler units."""

from __future__ import annotations

import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.kv.pool import KVPool
from localrun.engine.kv.radix import RadixCache
from localrun.engine.sampler import SamplingBatch, filtered_probs, sample
from localrun.engine.models.shapes import SHAPES
from parity import assert_greedy_parity

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, initializer_range=0.3)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        m = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        return m
    cfg = transformers.MistralConfig(**COMMON, sliding_window=None)
    return transformers.MistralForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
def test_tiny_models_match_transformers(kind, tmp_path):
    hf = _hf_model(kind).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                            max_num_batched_tokens=64))
    assert eng.tokenizer is None
    if kind == "qwen2":
        assert eng.model_config.attention_bias and eng.model_config.tie_word_embeddings
    if kind == "llama3":
        assert eng.model_config.rope_scaling["rope_type"] == "llama3"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 40, 90)]
    assert_greedy_parity(eng, hf, prompts, max_tokens=8)  # batched; the 90-token prompt is chunked (budget 64)
    assert eng.stats()["kv_pages_free"] + eng.stats()["cached_pages"] == eng.stats()["kv_pages_total"]


def test_random_shapes_run():
    cfg = SHAPES["smollm2-135m"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (576, 30, 9, 3, 49152)
    tiny = SHAPES["qwen2.5-0.5b"].__class__(64, 2, 4, 2, 128, 500, attention_bias=True, tie_word_embeddings=True)
    eng = LLMEngine.from_random(tiny, EngineConfig(device="cpu", max_model_len=128))
    out = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3))
    assert [o.completion_tokens for o in out] == [5, 5] and all(o.finish_reason == "length" for o in out)
    again = eng.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3))
    assert again[0].token_ids == out[0].token_ids  # per-request seed: same draw whatever the batch


def _pool(pages=16, page=4):
    return KVPool(SHAPES["smollm2-135m"].__class__(8, 1, 1, 1, 8, 10), pages, page, torch.float32, "cpu")


def test_radix_cache_match_split_lock_evict():
    pool = _pool()
    cache = RadixCache(pool)
    a = list(range(12))  # three pages of 4
    pa = pool.alloc(3)
    tree_pages, node = cache.insert(a, pa)
    assert tree_pages == pa and cache.num_pages == 3 and pool.refcount[pa[0]] == 2
    pool.decref(pa)  # the sequence is done; the tree keeps the pages
    b = list(range(8)) + [99, 98, 97, 96]
    pages, nb = cache.match_prefix(b)
    assert pages == pa[:2]  # split at the page boundary
    assert cache.match_prefix(list(range(7)))[0] == pa[:1]  # whole pages only
    cache.lock(nb)
    assert cache.evictable_pages == 1
    assert cache.evict(10) == 1 and cache.num_pages == 2  # only the unlocked leaf goes
    cache.unlock(nb)
    assert cache.evict(10) == 2 and pool.num_free == pool.num_pages


def test_radix_cache_dedups_concurrent_inserts():
    pool = _pool()
    cache = RadixCache(pool)
    toks = list(range(8))
    p1, p2 = pool.alloc(2), pool.alloc(2)
    assert cache.insert(toks, p1)[0] == p1
    assert cache.insert(toks, p2)[0] == p1  # the caller swaps to the tree's pages
    assert cache.num_pages == 2


def test_pool_alloc_refcounts():
    pool = _pool(pages=4)
    a = pool.alloc(3)
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.num_free == 3
    pool.decref(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.alloc(5)


def _draw(logits, params, history=None):
    """One batched sampler call; histories are prompt tokens (penalties look at them)."""
    n = logits.shape[0]
    hist = history or [[]] * n
    b = SamplingBatch.build(params, hist, [len(h) for h in hist], [0] * n, [False] * n, logits.shape[1], "cpu")
    return sample(logits, b).to_host(b)


def _filter(logits, p):
    b = SamplingBatch.build([p], [[]], [0], [0], [False], logits.shape[-1], "cpu")
    return filtered_probs(logits[None], b)[0]


def test_sampler_filters_and_penalties():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _filter(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[2] == 0 and probs[3] == 0 and probs[:2].sum() == pytest.approx(1.0)
    probs = _filter(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert (probs > 0).tolist() == [True, True, False, False]
    probs = _filter(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keep p >= 0.25
    assert (probs > 0).tolist() == [True, True, False, False]
    row = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    rep = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert _draw(row.clone(), [rep], [[0]])[0] == [2]  # 2.0/4 < 1.0
    pres = SamplingParams(temperature=0, presence_penalty=5.0)
    assert _draw(row.clone(), [pres], [[7, 0, 2]])[0] == [0]  # the prompt does not count ...
    b = SamplingBatch.build([pres], [[0, 2]], [0], [2], [False], 4, "cpu")  # ... the output does
    assert sample(row.clone(), b).to_host(b)[0] == [3]
    assert _draw(row.clone(), [SamplingParams(temperature=0)])[0] == [0]
    tok, lp = _draw(row.clone(), [SamplingParams(temperature=0, logprobs=2)])
    assert lp[0][0] == pytest.approx(torch.log_softmax(row[0], -1)[0].item()) and [i for i, _ in lp[0][1]] == [0, 2]


def test_bad_params_and_prompts_are_rejected():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    tiny = SHAPES["smollm2-135m"].__class__(32, 1, 2, 1, 64, 100)
    eng = LLMEngine.from_random(tiny, EngineConfig(device="cpu", max_model_len=32))
    with pytest.raises(ValueError, match="context window"):
        eng.generate([list(range(40))])
    with pytest.raises(ValueError, match="token ids"):
        eng.generate([[1, 100]])
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]])


def test_grouped_decode_matches_padded_reference():
    from localrun.kernels.ops import paged_decode_attention_ref

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(64, 4, 2, 8, generator=g), torch.randn(64, 4, 2, 8, generator=g)
    lens = torch.randint(1, 40, (20,), generator=g).tolist()
    table = torch.randperm(64, generator=g)[:60].repeat(4)[:200].view(20, 10).to(torch.int32)
    q = torch.randn(20, 4, 8, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, kc, vc, table, seq_lens, 0.3)
    assert torch.allclose(paged_decode_attention_ref(q, kc, vc, table, seq_lens, 0.3, lens=lens), ref, atol=1e-5)
    # and the padded reference itself equals attention over each sequence's gathered tokens
    for b in (0, 7, 19):
        k = kc[table[b].long()].reshape(-1, 2, 8)[: lens[b]].repeat_interleave(2, 1)
        v = vc[table[b].long()].reshape(-1, 2, 8)[: lens[b]].repeat_interleave(2, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b], k) * 0.3, -1)
        assert torch.allclose(torch.einsum("hl,lhd->hd", p, v), ref[b], atol=1e-5)
