"""The grammar engines behind structured outputs (moespec/structured.py): xgrammar and
llguidance, each compiling a constraint against the model's tokenizer and filling packed
bitmask rows, and `keywords`, which finds the JSON-schema keywords an engine would not enforce
exactly (such a schema is refused, never served loosely)."""
