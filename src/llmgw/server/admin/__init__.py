"""The admin pages (issue 15): server-rendered HTML over the read models, a canvas for fabrics."""
