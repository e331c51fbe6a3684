"""Chat templates: Jinja ones in a bounded sandbox (``chat``), Ollama's Go ones as Ollama renders them (``go``).

``localrun.templates.chat.render_chat`` is the one entry point: the daemon and the native engine render
every chat through it, and it sends a template written in Go's language to ``localrun.templates.go``.
"""
