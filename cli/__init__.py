"""The `ucudnn` command."""
