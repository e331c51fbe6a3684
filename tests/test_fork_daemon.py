"""n > 1 over real HTTP with the native engine (a daemon, its runner process, the OpenAI SDK):
the choices run as one group that prefills the prompt once (GET /metrics shows it) and give
the same answers as separate requests; usage counts the prompt once, as OpenAI does."""

from __future__ import annotations

import re

import pytest

from daemon import MODEL, Daemon

pytestmark = pytest.mark.timeout(300)

openai = pytest.importorskip("openai")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{model=\"{re.escape(MODEL)}\"\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_n_choices_share_one_prefill_over_http(tmp_path):
    d = Daemon(tmp_path / "home", LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="512")
    try:
        d.pull()
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, n=3, temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
        texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
        assert texts[0] and texts == [texts[0]] * 3
        prompt = r.usage.prompt_tokens
        assert prompt > 10 and r.usage.completion_tokens == 3 * 8  # the prompt counted once, as OpenAI does
        m = d.http.get("/metrics").text
        assert _metric(m, "localrun_prefill_tokens_total") == prompt  # the first request: nothing cached
        assert _metric(m, "localrun_forked_sequences_total") == 2

        one = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8,
                                             extra_body={"ignore_eos": True})
        assert one.choices[0].message.content == texts[0] and one.usage.prompt_tokens == prompt

        # streamed and seeded: choice i draws with seed + i, the same as a lone request with that seed
        stream = client.chat.completions.create(model=MODEL, messages=msgs, n=2, temperature=1.0, seed=7,
                                                max_tokens=8, stream=True, extra_body={"ignore_eos": True})
        got = ["", ""]
        for chunk in stream:
            for c in chunk.choices:
                got[c.index] += c.delta.content or ""
        for i in range(2):
            alone = client.chat.completions.create(model=MODEL, messages=msgs, temperature=1.0, seed=7 + i,
                                                   max_tokens=8, extra_body={"ignore_eos": True})
            assert alone.choices[0].message.content == got[i]
        m = d.http.get("/metrics").text
        assert _metric(m, "localrun_forked_sequences_total") == 3
        assert _metric(m, "localrun_kv_pages_used") >= 0
    finally:
        d.stop()
