"""Data pipeline: indexed datasets, GPT samples, samplers, masks and named corpora."""
from .corpora import resolve_corpus, resolve_data_path
from .gpt_dataset import BlendableDataset, GPTDataset, build_train_valid_test_datasets
from .indexed_dataset import (IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder,
                              best_fitting_dtype, make_builder, make_dataset)
from .masks import get_ltor_masks_and_position_ids
from .samplers import MegatronPretrainingSampler

__all__ = ["BlendableDataset", "GPTDataset", "IndexedDatasetError", "MMapIndexedDataset", "MMapIndexedDatasetBuilder",
           "MegatronPretrainingSampler", "best_fitting_dtype", "build_train_valid_test_datasets",
           "get_ltor_masks_and_position_ids", "make_builder", "make_dataset", "resolve_corpus", "resolve_data_path"]
