"""A small reader of the Dockerfiles under packaging/ (the instructions they use: FROM, ARG, ENV,
RUN, CMD, HEALTHCHECK, ...), so tests start the daemon exactly as an image would and compare the
files with the README, without Docker."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    image: str  # FROM, with the ARGs declared before the first FROM substituted
    name: str | None
    args: dict[str, str] = field(default_factory=dict)  # ARGs declared in this stage (name -> default)
    env: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    cmd: list[str] | None = None
    healthcheck: list[str] | None = None
    user: str | None = None
    volumes: list[str] = field(default_factory=list)
    expose: list[str] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]
    comments: list[str]  # the comment lines, '#' stripped

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def all_args(self) -> dict[str, str]:
        out = dict(self.global_args)
        for st in self.stages:
            out.update(st.args)
        return out

    def substitute(self, text: str) -> str:
        """${NAME} / $NAME of the ARGs replaced by their defaults."""
        args = self.all_args()
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def _instructions(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    out, comments, cur = [], [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            comments.append(line[1:].strip())
            continue
        if not line and not cur:
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        cur = ""
    return out, comments


def _exec_form(rest: str) -> list[str]:
    if rest.startswith("["):
        return json.loads(rest)
    return ["/bin/sh", "-c", rest]


def _env_pairs(rest: str, known: dict[str, str]) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy form: ENV NAME value with spaces
        return {words[0]: " ".join(words[1:])}
    out = {}
    for w in words:
        k, _, v = w.partition("=")
        out[k] = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: {**known, **out}.get(m.group(1) or m.group(2), m.group(0)), v)
    return out


def parse(path: Path) -> Dockerfile:
    instructions, comments = _instructions(path.read_text(encoding="utf-8"))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for word, rest in instructions:
        if word == "ARG":
            name, _, default = rest.partition("=")
            target = stages[-1].args if stages else global_args
            target[name.strip()] = default.strip().strip('"')
        elif word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args.get(m.group(1) or m.group(2), m.group(0)),
                           parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image=image, name=name))
        elif not stages:
            raise ValueError(f"{path}: {word} before FROM")
        elif word == "ENV":
            stages[-1].env.update(_env_pairs(rest, stages[-1].env))
        elif word == "RUN":
            stages[-1].runs.append(rest)
        elif word == "CMD":
            stages[-1].cmd = _exec_form(rest)
        elif word == "HEALTHCHECK":
            words = rest.split()
            while words and words[0].startswith("--"):
                words.pop(0)
            assert words and words[0] == "CMD", rest
            stages[-1].healthcheck = _exec_form(rest[rest.index("CMD") + 3:].strip())
        elif word == "USER":
            stages[-1].user = rest
        elif word == "VOLUME":
            stages[-1].volumes += json.loads(rest) if rest.startswith("[") else rest.split()
        elif word == "EXPOSE":
            stages[-1].expose += rest.split()
    return Dockerfile(path, global_args, stages, comments)


def shell_commands(run: str) -> list[str]:
    """A RUN line's (or a README line's) commands split at &&, || and ; outside quotes, each with
    its whitespace collapsed."""
    parts, cur, quote, i = [], "", None, 0
    while i < len(run):
        c = run[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif run.startswith(("&&", "||"), i) or c == ";":
            parts.append(cur)
            cur = ""
            i += 1 if c == ";" else 2
            continue
        cur += c
        i += 1
    parts.append(cur)
    return [" ".join(p.split()) for p in parts if p.strip()]
