"""Tool calling: the families' call formats parsed as they stream (parsers, on base), the generic format for
templates that teach none (generic), and the grammars that enforce a required or named call, or any generic
answer (grammar)."""
