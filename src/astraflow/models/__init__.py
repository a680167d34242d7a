"""Model helpers: random-init transformers models and tiny local tokenizers, built offline."""
