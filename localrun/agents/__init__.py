"""Coding agents (Claude Code, Codex CLI) pointed at an OpenAI/Anthropic-compatible server: their
binaries, argv and environment (command.py), the model metadata and `--lean` profile given to each
(profiles.py). Used by `localrun launch` and `localrun bench agents`; imports nothing of localrun's."""
