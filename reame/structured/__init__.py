"""Structured output: GBNF grammars (parsed, checked, followed), JSON schema to GBNF, what a request asks its
answer to match, and tool calls (their grammars and their parsing out of the text). Below the engine and
speculative decoding, which follow grammars; the HTTP layer maps its errors to 400."""
