"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by a grammar engine
(llguidance and xgrammar; `auto` routes each constraint to one), one matcher per constrained sequence, and the token bitmasks
the sampler applies on the device.

`StructuredOutputManager` (grammar.py) is the engine's entry point: it compiles off the step loop in a
thread pool with a cache, creates a `RequestGrammar` per sequence, fills the bitmask rows of a step and
checks speculative drafts against the grammar. A schema is enforced exactly or refused (json_schema.py).
The sampler applies the bitmasks (atlas/runtime/sampler.py, `apply_token_bitmask`).
"""

from atlas.structured.grammar import GrammarCompileError, RequestGrammar, StructuredOutputManager

__all__ = ["GrammarCompileError", "RequestGrammar", "StructuredOutputManager"]
