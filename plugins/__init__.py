"""Built-in plugins: one module per family, each a tactic spec plus a hookimpl."""
