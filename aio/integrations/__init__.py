"""Integrations with other training stacks (DeepSpeed)."""
