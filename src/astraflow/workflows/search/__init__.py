"""The search workload: question answering with a BM25 search tool over a local corpus (`search`)."""
