"""Pure fabric parsers and analysis: text from the tools and sysfs in, values out, no I/O."""
