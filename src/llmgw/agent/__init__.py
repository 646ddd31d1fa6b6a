"""The node agent: discovery, the link to the server, the engine supervisor."""
