"""Recorded gpt-oss (harmony) outputs and what each parses into: (reasoning, content, tool calls).

Each text is what the model writes after the generation prompt (``...<|start|>assistant``), with the
special tokens as text (the backends keep them for a harmony chat). Written after gpt-oss-20b's
outputs in the openai-harmony spec's examples and llama.cpp's gpt-oss chat parser tests: the
analysis channel, a final answer, a commentary preamble, calls with the recipient after the channel
(the model's usual order) and before it (the template's), an output cut by max_tokens, and text
outside the Latin script. ``<|return|>`` and ``<|call|>`` end a turn (end-of-generation tokens: llama.cpp
makes them so by name, so a real turn holds one call; two in one output is what a client replaying
or a lenient backend may give): some samples keep them, as a backend that passes them on would,
some end without them.
"""

from __future__ import annotations

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]
TOOL_NAMES = {"get_weather", "get_time"}

# name -> (model output, reasoning, content, [(tool name, arguments)], finish: "stop" | "length")
SAMPLES: dict[str, tuple[str, str, str, list[tuple[str, dict]], str]] = {
    "analysis_final": (
        "<|channel|>analysis<|message|>The user greets me. Respond politely and briefly.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help you today?<|return|>",
        "The user greets me. Respond politely and briefly.", "Hello! How can I help you today?", [], "stop"),
    "final_only": (
        "<|channel|>final<|message|>The capital of France is **Paris**.\n\n- population: ~2.1M\n- river: Seine",
        "", "The capital of France is **Paris**.\n\n- population: ~2.1M\n- river: Seine", [], "stop"),
    "analysis_call": (
        "<|channel|>analysis<|message|>User asks: \"What's the weather in Paris?\" We need to call get_weather "
        "with city \"Paris\".<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        "<|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
        "User asks: \"What's the weather in Paris?\" We need to call get_weather with city \"Paris\".", "",
        [("get_weather", {"city": "Paris"})], "stop"),
    "two_calls": (
        "<|channel|>analysis<|message|>Need both the weather and the time in Tokyo. Call both tools.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "{\"city\": \"Tokyo\", \"unit\": \"celsius\"}<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
        "{\"timezone\": \"Asia/Tokyo\"}<|call|>",
        "Need both the weather and the time in Tokyo. Call both tools.", "",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"}), ("get_time", {"timezone": "Asia/Tokyo"})], "stop"),
    "preamble_call": (
        "<|channel|>analysis<|message|>Should tell the user what I'm doing, then call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check the current weather in Berlin for you."
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "{\"city\":\"Berlin\",\"unit\":\"celsius\"}",
        "Should tell the user what I'm doing, then call the tool.",
        "Let me check the current weather in Berlin for you.",
        [("get_weather", {"city": "Berlin", "unit": "celsius"})], "stop"),
    "recipient_first": (
        "<|channel|>analysis<|message|>Time in New York requested.<|end|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        "{\"timezone\":\"America/New_York\"}<|call|>",
        "Time in New York requested.", "", [("get_time", {"timezone": "America/New_York"})], "stop"),
    "truncated_analysis": (
        "<|channel|>analysis<|message|>The user wants a proof that there are infinitely many primes. "
        "Classic Euclid argument: assume finitely many, multiply them and add one; the result is",
        "The user wants a proof that there are infinitely many primes. Classic Euclid argument: assume finitely "
        "many, multiply them and add one; the result is", "", [], "length"),
    "truncated_mid_marker": (
        "<|channel|>analysis<|message|>Short thought.<|end|><|start|>assistant<|channel|>final<|message|>Ans<|e",
        "Short thought.", "Ans", [], "length"),
    "unicode": (
        "<|channel|>analysis<|message|>ユーザーは東京の天気を尋ねている。Zürich も？ 🤔 Call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "{\"city\": \"Zürich\", \"unit\": \"°C\"}<|call|>",
        "ユーザーは東京の天気を尋ねている。Zürich も？ 🤔 Call the tool.", "",
        [("get_weather", {"city": "Zürich", "unit": "°C"})], "stop"),
    "unicode_final": (
        "<|channel|>analysis<|message|>Réponse en français, avec le symbole euro.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Ça coûte 5 € — très bon marché ! 🎉",
        "Réponse en français, avec le symbole euro.", "Ça coûte 5 € — très bon marché ! 🎉", [], "stop"),
    "two_analyses": (
        "<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "Second thought.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
        "First thought.\n\nSecond thought.", "Done.", [], "stop"),
    "not_harmony": (
        "Plain text, no channels: <b>as written</b>.", "", "Plain text, no channels: <b>as written</b>.", [], "stop"),
}




def harmony_gguf(src, dst, template: str):
    """A copy of the GGUF `src` (SmolLM2) at `dst` whose first spare special tokens are renamed to
    harmony's markers (control tokens, as in gpt-oss's vocabulary) and whose chat template is
    `template` (gpt-oss's): a real model both backends load whose vocabulary has the markers as
    single special tokens, so a grammar can make it write a recorded harmony output token by token."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from localrun.server.harmony import HARMONY_TOKENS

    reader = gguf.GGUFReader(str(src))
    tokens = list(reader.get_field(gguf.Keys.Tokenizer.LIST).contents())
    types = list(reader.get_field(gguf.Keys.Tokenizer.TOKEN_TYPE).contents())
    spare = [i for i in range(3, len(tokens)) if types[i] == gguf.TokenType.CONTROL][:len(HARMONY_TOKENS)]
    assert len(spare) == len(HARMONY_TOKENS), "the model has too few spare control tokens"
    for i, t in zip(spare, HARMONY_TOKENS):
        tokens[i] = t
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {
        gguf.Keys.Tokenizer.LIST: MetadataDetails(gguf.GGUFValueType.ARRAY, tokens, sub_type=gguf.GGUFValueType.STRING),
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template)}, [])
    return dst
__all__ = ["SAMPLES", "TOOLS", "TOOL_NAMES", "harmony_gguf"]
