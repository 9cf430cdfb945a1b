"""The Prefect flows, their tasks and deployments: what a data team deploys and runs. Import the flows
from here (`from frenzy_prefect.flows import train_llm`)."""

from frenzy_prefect.flows.datasets import prepare_dataset_flow, watch_datasets
from frenzy_prefect.flows.training import distributed_train, train_llm

__all__ = ["distributed_train", "prepare_dataset_flow", "train_llm", "watch_datasets"]
