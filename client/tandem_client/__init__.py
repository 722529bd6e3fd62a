"""tandem client: tritonclient gRPC streaming and the `tandem` CLI."""
