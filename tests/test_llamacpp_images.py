"""Images in the batched llama.cpp loop (the backend, in process), on the tiny random Gemma 3 VLM:
greedy answers agree with llama.cpp's own multimodal path (libmtmd's helper evaluating the prompt),
a different image gives a different answer, an image in a shared prefix is cached like text (whole,
keyed by its bytes), images run beside text-only requests, bad images are clear errors."""

from __future__ import annotations

import asyncio

import pytest
from vlm_model import mtmd_reference, png

from localrun.backends.base import MEDIA_MARKER, GenerationRequest, LoadSpec, SamplingOptions
from localrun.errors import InvalidRequest

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("llama_cpp")
pytest.importorskip("PIL")

RED, BLUE, NOISE = png((255, 0, 0)), png((0, 0, 255), (48, 64)), png((0, 0, 0), (80, 80), noise_seed=0)


def prompt(n_images: int = 1, question: str = "what is in this picture") -> str:
    return f"<bos><start_of_turn>user\n{MEDIA_MARKER * n_images}{question}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def backend(vlm):
    from localrun.backends.llamacpp import LlamaCppBackend

    gguf, mmproj = vlm
    b = LlamaCppBackend(LoadSpec("tiny-vlm", gguf, "gguf", num_ctx=512, num_parallel=3,
                                 extra={"projector": str(mmproj), "n_threads": 2}))
    yield b
    asyncio.run(b.close())


async def answer(backend, images: list[bytes], text: str | None = None, n: int = 12, **opts):
    o = SamplingOptions(**{"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **opts})
    ids, last = [], None
    req = GenerationRequest(prompt=text or prompt(len(images)), options=o, images=images or None)
    async for ch in backend.generate(req):
        ids += ch.token_ids
        last = ch
    return ids, last.usage


def test_answers_agree_with_llama_cpp_and_follow_the_image(backend, vlm):
    assert backend.info.supports_images
    ours = {name: asyncio.run(answer(backend, [img]))[0] for name, img in (("red", RED), ("blue", BLUE),
                                                                        ("noise", NOISE))}
    for name, img in (("red", RED), ("blue", BLUE), ("noise", NOISE)):
        assert ours[name] == mtmd_reference(*vlm, prompt(), [img], 12), name
    assert len({tuple(v) for v in ours.values()}) == 3  # the image steers the answer


def test_an_image_in_a_shared_prefix_is_cached_whole(backend):
    ids1, u1 = asyncio.run(answer(backend, [RED], prompt(question="describe it")))
    ids2, u2 = asyncio.run(answer(backend, [RED], prompt(question="describe it")))
    assert ids2 == ids1 and u2.cached_tokens == u2.prompt_tokens - 2  # everything but the last two tokens
    # images not seen yet, at the same place: the cache serves the text before the image and stops there
    _, u3 = asyncio.run(answer(backend, [png((0, 255, 0))], prompt(question="describe it")))
    _, u4 = asyncio.run(answer(backend, [png((0, 255, 255))], prompt(question="describe it")))
    assert 0 < u3.cached_tokens == u4.cached_tokens and u3.cached_tokens + 16 < u2.cached_tokens
    assert u1.prompt_tokens == u3.prompt_tokens > 16  # image tokens counted
    st = asyncio.run(backend.stats())  # Gemma 3's sliding-window cache: prefixes are copied as whole streams
    assert st["copied_prefixes"] > 0 and st["copied_streams"] == st["copied_prefixes"] and st["copied_cells"] == 0, st


def test_two_images_and_text_only_requests_in_the_same_steps(backend, vlm):
    async def main():
        return await asyncio.gather(answer(backend, [BLUE, RED]),
                                    answer(backend, [], "<bos><start_of_turn>user\nhello<end_of_turn>\n"
                                                        "<start_of_turn>model\n"),
                                    answer(backend, [NOISE]))

    two, _, one = asyncio.run(main())
    assert two[0] == mtmd_reference(*vlm, prompt(2), [BLUE, RED], 12)
    assert one[0] == mtmd_reference(*vlm, prompt(), [NOISE], 12)
    assert asyncio.run(backend.stats())["image_tokens"] > 0


def test_an_image_encode_leaves_no_openmp_team_behind(backend):
    """The vision encoder computes on a thread that exits after each image: a helper thread that lived on
    kept an OpenMP team, and the loop's barriers then slept instead of spinning (this tiny model's text
    went from ~11,000 to ~440 tokens/s after one image on 2 CPUs)."""
    import os
    import time

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc")
    asyncio.run(answer(backend, [], prompt(0), n=2))  # the loop's own team exists
    before = len(os.listdir("/proc/self/task"))
    assert asyncio.run(answer(backend, [png((9, 99, 199))], n=2))[0]
    deadline = time.monotonic() + 3
    while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/task")) <= before


def test_bad_images_are_clear_errors(backend, smollm2_gguf):
    with pytest.raises(InvalidRequest, match="image 1 could not be decoded"):
        asyncio.run(answer(backend, [b"\x89PNG\r\n\x1a\n not really"]))
    with pytest.raises(InvalidRequest, match="2 image place"):
        asyncio.run(answer(backend, [RED], prompt(2)))
    assert asyncio.run(backend.stats())["running"] == 0
    assert asyncio.run(answer(backend, [RED]))[0]  # still serving

    from localrun.backends.llamacpp import LlamaCppBackend

    text_only = LlamaCppBackend(LoadSpec("smollm2:135m", smollm2_gguf, "gguf", num_ctx=256, num_parallel=1))
    try:
        assert not text_only.info.supports_images
        with pytest.raises(InvalidRequest, match="no vision projector"):
            asyncio.run(answer(text_only, [RED], "hi " + MEDIA_MARKER))
    finally:
        asyncio.run(text_only.close())
