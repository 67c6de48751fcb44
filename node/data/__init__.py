"""The head stage's text: tokenizers, corpora, splits and batches."""
