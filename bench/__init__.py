"""Serving benchmark (`make bench`): our Ray Serve app against transformers baselines; see README.md here."""
