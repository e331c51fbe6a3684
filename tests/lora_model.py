"""The LoRA test adapters (no package ships one): random PEFT adapters written by tests/tools/tiny_lora.py (one for
the bundled SmolLM2-135M, one for another llama that fits none of its layers) and converted by llama.cpp's
convert_lora_to_gguf.py from the llama-cpp-python sdist, cached under the pytest cache directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vlm_model import write_hf_model


def build_loras(cache: Path) -> tuple[Path, Path]:
    """(SmolLM2-135M's adapter GGUF, the other model's), built once into ``cache``."""
    out = cache / "tiny-lora"
    paths = (out / "smollm2-lora.gguf", out / "other-lora.gguf")
    if all(p.exists() for p in paths):
        return paths
    hf, vendor, env = write_hf_model("tiny_lora.py", out, cache)
    for path, name in zip(paths, ("smollm2", "other")):
        tmp = path.with_name(path.name + ".part")
        r = subprocess.run([sys.executable, str(vendor / "convert_lora_to_gguf.py"), "--base", str(hf / name / "base"),
                            "--outtype", "f32", "--outfile", str(tmp), str(hf / name / "lora")],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        tmp.rename(path)
    return paths
