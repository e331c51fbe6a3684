"""Structured output: JSON schema to grammar, bounds, GBNF, regex/choices/grammar constraints, llguidance masks.

Used by both backends and the daemon; imports nothing of theirs.

- ``bounds``: how much grammar a JSON schema may ask for (its counts, size and depth).
- ``gbnf``: a JSON schema as llama.cpp's grammar (GBNF), with localrun's fixes to the converter.
- ``constraints``: a request's own regex, choices or GBNF grammar, and JSON schemas, as llguidance's grammar;
  the llama.cpp backend's llguidance matchers.
- ``masks``: the native engine's llguidance grammars and the torch token masks they fill (imports torch).
"""
