"""Offline augmentation: cached EDA variants per sentence and a faiss word-vector synonym cache."""
