"""Click commands: parse, call, render. No logic worth testing alone lives here."""
