"""`localrun run MODEL PROMPT --image PATH` and image paths inside the prompt (Ollama's habit), as a
subprocess against the real daemon serving the tiny vision model (tests/vlm_model.py) on llama.cpp:
the CLI's greedy answer equals what the ollama SDK gets from /api/chat with the same image, a
different image changes it, and a bad file is a CLI message with exit 1 before anything is sent.
Plus the attachment helpers (localrun/attachments.py) on their own."""

from __future__ import annotations

import pytest
from daemon import Daemon
from test_cli import assert_clean_error, cli, free_port, make_env
from vlm_model import png, vision_daemon

from localrun.attachments import MAX_IMAGE_FILE_BYTES, AttachmentError, is_image_path, read_image, split_image_paths

pytestmark = pytest.mark.timeout(300)
RED, NOISE = png((255, 0, 0)), png((0, 0, 0), (80, 80), noise_seed=0)
GREEDY = {"temperature": 0, "num_predict": 10, "seed": 1}
FAST = [x for k, v in GREEDY.items() for x in ("-o", f"{k}={v}")]
QUESTION = "describe"  # the tiny random model answers this one with text (some questions: EOS at once)


@pytest.fixture
def pics(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "noise.png").write_bytes(NOISE)
    (tmp_path / "my cat.png").write_bytes(RED)
    (tmp_path / "notes.png").write_text("not an image\n")
    (tmp_path / "huge.jpg").write_bytes(b"\xff\xd8\xff" + b"\0" * MAX_IMAGE_FILE_BYTES)
    return tmp_path


def test_image_paths_inside_a_prompt_leave_it(pics):
    assert split_image_paths("describe ./red.png", pics) == ("describe", ["./red.png"])
    assert split_image_paths("compare red.png and noise.png.", pics) == ("compare and.", ["red.png", "noise.png"])
    assert split_image_paths('what is in "my cat.png"?', pics) == ("what is in?", ["my cat.png"])
    assert split_image_paths(r"what is in my\ cat.png", pics) == ("what is in", ["my cat.png"])
    # a name that is no file, or not an image's name, stays text
    assert split_image_paths("draw a cat.png for me", pics) == ("draw a cat.png for me", [])
    assert split_image_paths("see ./red.pngs", pics) == ("see ./red.pngs", [])
    assert split_image_paths(f"{pics}/red.png", None) == ("", [f"{pics}/red.png"])
    assert is_image_path(f"'{pics}/my cat.png' ") == f"{pics}/my cat.png"
    assert is_image_path(f"{pics}/red.png please") is None and is_image_path("/help") is None


def noise_webp() -> bytes:
    """NOISE's pixels as a lossless WebP."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(NOISE)).save(out, format="WEBP", lossless=True)
    return out.getvalue()


def test_a_webp_is_sent_as_png_of_the_same_pixels(pics, monkeypatch):
    import io

    import numpy as np
    from PIL import Image

    (pics / "noise.webp").write_bytes(noise_webp())
    a = read_image("noise.webp", pics)
    assert a.kind == "webp→png" and a.data.startswith(b"\x89PNG")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(a.data))), np.asarray(Image.open(io.BytesIO(NOISE))))
    (pics / "bad.webp").write_bytes(b"RIFF\x10\x00\x00\x00WEBPVP8 junk")
    with pytest.raises(AttachmentError, match="could not be decoded as WebP"):
        read_image("bad.webp", pics)
    monkeypatch.setenv("LOCALRUN_IMAGE_MAX_PIXELS", "1000")  # 80x80 is more: refused before decoding
    with pytest.raises(AttachmentError, match="80x80 pixels; at most 1000"):
        read_image("noise.webp", pics)


def test_bad_image_files_are_clear_errors(pics):
    assert read_image("red.png", pics).data == RED and read_image(pics / "red.png").kind == "png"
    import os

    os.mkfifo(pics / "pipe.png")  # reading it would block: refused without opening it
    for name, msg in (("nope.png", "no such file"), ("notes.png", "not an image"), ("huge.jpg", "too large"),
                      (".", "not a regular file"), ("pipe.png", "not a regular file")):
        with pytest.raises(AttachmentError, match=msg):
            read_image(name, pics)


def test_cli_refuses_a_bad_image_before_asking_the_daemon(pics):
    env = make_env(pics, free_port())  # no daemon listens there: the file is checked first
    for args, msg in ((["--image", "nope.png"], "nope.png: no such file"), (["--image", "notes.png"], "not an image"),
                      (["--image", "huge.jpg"], "too large"), (["describe ./notes.png"], "not an image"),
                      (["--image", "red.png", "--image", str(pics)], "not a regular file")):
        r = cli(env, "--no-autostart", "run", "m", "hi", *args, cwd=pics)
        err = assert_clean_error(r, code=1)
        assert msg in err, err


@pytest.fixture(scope="module")
def daemon(vlm, smollm2_gguf, tmp_path_factory):
    with vision_daemon(tmp_path_factory.mktemp("cli-images-home"), vlm, smollm2_gguf) as d:
        yield d


def sdk_answer(d: Daemon, image: bytes, question: str = QUESTION) -> str:
    import ollama

    c = ollama.Client(host=d.url)
    r = c.chat(model="vlm", messages=[{"role": "user", "content": question, "images": [image]}], options=GREEDY)
    return r.message.content


def test_run_with_an_image_answers_as_the_api_does(daemon, pics):
    env = make_env(pics, daemon.port)
    r = cli(env, "--no-autostart", "run", "vlm", QUESTION, "--image", "red.png", *FAST, cwd=pics)
    assert r.returncode == 0, r.stderr
    red = sdk_answer(daemon, RED)
    assert red.strip() and r.stdout == red + ("" if red.endswith("\n") else "\n")
    # the same picture written inside the prompt: the same question reaches the model
    r2 = cli(env, "--no-autostart", "run", "vlm", "describe ./red.png", *FAST, cwd=pics)
    assert r2.returncode == 0 and r2.stdout == r.stdout, r2.stderr
    # a different picture gives a different answer, the same one as the API's
    r3 = cli(env, "--no-autostart", "run", "vlm", QUESTION, "--image", str(pics / "noise.png"), *FAST)
    noise = sdk_answer(daemon, NOISE)
    assert r3.returncode == 0 and r3.stdout.rstrip("\n") == noise.rstrip("\n") and noise != red, r3.stderr
    # the same pixels as a WebP (sent as PNG): the same answer
    (pics / "noise.webp").write_bytes(noise_webp())
    r5 = cli(env, "--no-autostart", "run", "vlm", f"{QUESTION} ./noise.webp", *FAST, cwd=pics)
    assert r5.returncode == 0 and r5.stdout == r3.stdout, r5.stderr
    # two images (repeatable --image)
    r4 = cli(env, "--no-autostart", "run", "vlm", "compare", "--image", "red.png", "--image", "noise.png", *FAST,
             cwd=pics)
    assert r4.returncode == 0 and r4.stdout.strip(), r4.stderr


def test_run_with_an_image_on_a_text_model_says_why(daemon, pics):
    r = cli(make_env(pics, daemon.port), "--no-autostart", "run", "text", QUESTION, "--image", "red.png", *FAST,
            cwd=pics)
    err = assert_clean_error(r, code=1)
    assert "cannot take images: it has no vision projector" in err, err
    assert daemon.http.get("/api/tags").status_code == 200


def test_plain_repl_attaches_image_paths_in_a_message(daemon, pics):
    """`run --plain` with piped lines (one message each): image paths in a line go with it as images,
    an absolute path at the start is not taken for a /command, a bad file is reported and skipped."""
    env = make_env(pics, daemon.port)
    lines = f"describe ./red.png\n./notes.png describe\n{pics}/noise.png describe\n"
    r = cli(env, "--no-autostart", "run", "vlm", "--plain", *FAST, input=lines, cwd=pics)
    assert r.returncode == 0, r.stderr
    assert "Added image ./red.png" in r.stderr and f"Added image {pics}/noise.png" in r.stderr
    assert "notes.png is not an image" in r.stderr and "Unknown command" not in r.stderr + r.stdout
    red = sdk_answer(daemon, RED)
    assert r.stdout.startswith(red), (r.stdout, red)  # the first turn: the same as the API's answer
