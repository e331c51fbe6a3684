"""The generation service and n > 1 (in-process daemon, fake backend): a backend that shares
the prefill (BackendInfo.supports_groups) gets the n choices as one group, all started at once;
one that does not (llama.cpp) still gets n plain requests, one after another. A choice the
backend refuses at its start is an HTTP error, and every stream of the group is closed."""

from __future__ import annotations

import httpx
import pytest
from fakes import DEFAULT_REPLY, MODEL, FakeModel, InProcessDaemon, library_home, wait_until

pytestmark = pytest.mark.timeout(120)

MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return library_home(tmp_path_factory.mktemp("fork_home"))


@pytest.mark.parametrize("groups", [True, False])
def test_n_choices_as_a_group_or_one_by_one(home, groups):
    fake = FakeModel(token_delay=0.002, supports_groups=groups)
    d = InProcessDaemon(home, fake)
    try:
        r = httpx.post(d.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": MSGS, "n": 3, "seed": 5, "max_tokens": 6})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["message"]["content"] for c in body["choices"]] == [DEFAULT_REPLY[:6]] * 3
        reqs = fake.requests
        assert [q.options.seed for q in reqs] == [5, 6, 7]  # choice i: seed + i, as before
        assert body["usage"]["prompt_tokens"] == len(reqs[0].prompt_token_ids)  # once, not 3 times
        assert body["usage"]["completion_tokens"] == 18
        if groups:
            gids = {q.group[0] for q in reqs}
            assert len(gids) == 1 and [q.group[1:] for q in reqs] == [(3, 0), (3, 1), (3, 2)]
            assert fake.running_at_start == [0, 1, 2]  # all started at once
        else:
            assert all(q.group is None for q in reqs)
            assert fake.running_at_start == [0, 0, 0]  # each after the one before had finished
    finally:
        d.stop()


def test_a_refused_choice_fails_the_request_and_closes_the_others(home):
    fake = FakeModel(token_delay=0.01, supports_groups=True, fail_first={1})
    d = InProcessDaemon(home, fake)
    try:
        r = httpx.post(d.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": MSGS, "n": 3, "max_tokens": 50})
        assert r.status_code == 400 and "choice 1 refused" in r.text
        assert len(fake.requests) == 3
        # the choices that had started are aborted, and the slot is free again
        wait_until(lambda: fake.running == 0 and d.state.manager.runners[MODEL].active == 0, timeout=5)
        assert sorted(fake.aborted) == sorted(q.request_id for q in fake.requests if q.group[2] != 1)
        r = httpx.post(d.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": MSGS, "max_tokens": 4})
        assert r.status_code == 200
    finally:
        d.stop()
