"""HTTP for the public port and for talking to engines: minimal HTTP/1.1 framing on trio."""
