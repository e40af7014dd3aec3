"""quantplan: plan low-precision LLM serving layer by layer (command line and launcher)."""
