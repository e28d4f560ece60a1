"""The engine: one training loop (``loop.train``) shared by every strategy and launcher."""
