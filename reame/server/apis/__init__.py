"""One module per API family, each a list of routes over the shared Service."""
