"""The command line's argparse parser: the global flags and every verb's own."""

from __future__ import annotations

import argparse

from localrun.cli.common import PROG
from localrun.cli.daemon import serve_epilog


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run language models locally: a daemon with a model library and an "
        "OpenAI-compatible + Ollama-shaped API, and this CLI as its client.")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("--host", metavar="HOST:PORT", help="daemon address (default: LOCALRUN_HOST)")
    p.add_argument("--no-autostart", action="store_true",
                   help="fail instead of starting the daemon in the background when none answers")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.set_defaults(verb_parsers=sub.choices)  # each verb's own parser, for its usage errors

    def add(name, help_text, **kw):
        return sub.add_parser(name, help=help_text, description=help_text, **kw)

    s = add("serve", "run the daemon in the foreground", epilog=serve_epilog(),
            formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--host", dest="serve_host", metavar="HOST:PORT", help="address to bind (sets LOCALRUN_HOST)")

    s = add("pull", "download a model into the library")
    s.add_argument("model")

    s = add("run", "run a model: answer PROMPT, or chat when none is given")
    s.add_argument("model")
    s.add_argument("prompt", nargs="*", help="the prompt (piped stdin is appended)")
    s.add_argument("--verbose", action="store_true", help="print timing stats (TTFT, tok/s, token counts)")
    s.add_argument("--format", metavar="json|SCHEMA",
                   help="constrain the answer to JSON: 'json', or a JSON schema (inline or a .json file)")
    s.add_argument("--keepalive", metavar="DURATION", help="how long the model stays loaded (e.g. 5m, 0, -1)")
    s.add_argument("-o", "--option", action="append", metavar="NAME=VALUE",
                   help="a generation option, e.g. -o temperature=0 -o num_predict=64 (repeatable)")
    s.add_argument("--nowordwrap", action="store_true", help="don't break lines between words on a terminal")
    s.add_argument("--think", nargs="?", const="true", metavar="true|false|low|medium|high",
                   help="ask a thinking model to think (the default is its template's), or not (--think=false)")
    s.add_argument("--hidethinking", action="store_true", help="don't print a thinking model's thoughts")
    s.add_argument("--plain", action="store_true",
                   help="chat in a plain line REPL instead of the TUI (with piped stdin: one message per line)")
    s.add_argument("--image", action="append", metavar="PATH",
                   help="attach an image file to the prompt (repeatable; for vision models). An image file's "
                        "path written inside the prompt is attached too")
    s.add_argument("--truncate", nargs="?", const="true", metavar="true|false",
                   help="embedding models: cut an input longer than the context (the default), or with "
                        "--truncate=false fail instead")
    s.add_argument("--dimensions", type=int, metavar="N",
                   help="embedding models: keep the embedding's first N dimensions (normalized again)")

    s = add("chat", "open the chat TUI")
    s.add_argument("model", nargs="?")

    s = add("list", "list the models in the library", aliases=["ls"])

    s = add("show", "show a model's details, Modelfile and weights path")
    s.add_argument("model")
    g = s.add_mutually_exclusive_group()
    for field in ("modelfile", "parameters", "system", "template", "license"):
        g.add_argument(f"--{field}", action="store_true", help=f"print only the {field}")
    s.add_argument("--verbose", action="store_true", help="also print all model metadata")

    s = add("ps", "list the loaded models")
    s.add_argument("-v", "--verbose", action="store_true", help="also show context, slots and why this backend")

    s = add("stop", "unload a running model")
    s.add_argument("model")

    s = add("rm", "remove models from the library")
    s.add_argument("models", nargs="+", metavar="MODEL")

    s = add("cp", "copy a model under a new name")
    s.add_argument("source")
    s.add_argument("destination")

    s = add("create", "create a model from a Modelfile")
    s.add_argument("name")
    s.add_argument("-f", "--file", default="Modelfile", help="path to the Modelfile (default: ./Modelfile)")
    s.add_argument("-q", "--quantize", metavar="TYPE",
                   help="store the GGUF model quantized to TYPE by llama.cpp (e.g. q4_K_M, q8_0; the model must be "
                        "F16, BF16 or F32), as `ollama create --quantize` does")

    s = add("launch", "start a coding agent (Claude Code or Codex CLI) pointed at the daemon, with the model's "
            "full trained context")
    s.add_argument("agent", choices=["claude", "codex"])
    s.add_argument("--model", help="the model the agent uses (default: the library's only model)")
    s.add_argument("--lean", action="store_true", help="the agent's own minimal settings: short instructions and "
                   "the few tools a task needs (for small models)")
    # the agent's own arguments come after `--` (main() splits them off before parsing: an argparse
    # REMAINDER positional would swallow `--model M` too)
    s.set_defaults(agent_args=[])
    s.epilog = "arguments for the agent go after --, e.g. -- -p 'Say hello' or -- exec 'Say hello'"

    add("bench", "benchmarks (see `localrun bench --help`)")
    add("ray-serve", "serve a model with replicas on a Ray cluster (see `localrun ray-serve --help`)")
    add("version", "print the client and daemon versions")
    return p
