"""train: Equinox + optax training loops on omicsio_jax datasets (uses only omicsio_jax's public API).

>>> from train import TrainConfig, fit                                          # doctest: +SKIP
>>> result = fit(TrainConfig("out/", "drug", eval_where="batch = 'plate_09'",
...                          checkpoint_dir="ckpt/", checkpoint_every=200))       # doctest: +SKIP
>>> result.eval.accuracy, result.eval.macro_f1                                   # doctest: +SKIP
"""

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._checkpoint import list_checkpoints as list_checkpoints
from ._checkpoint import save_checkpoint as save_checkpoint
from ._cli import main as main
from ._config import TrainConfig as TrainConfig
from ._embed import embed as embed
from ._embed import load_pretrained as load_pretrained
from ._embed import logistic_probe as logistic_probe
from ._embed import masked_prediction as masked_prediction
from ._embed import probe_pretraining as probe_pretraining
from ._embed import probe_split as probe_split
from ._errors import CheckpointMismatchError as CheckpointMismatchError
from ._errors import PredicateError as PredicateError
from ._errors import TrainError as TrainError
from ._finetune import FinetuneResult as FinetuneResult
from ._finetune import finetune as finetune
from ._finetune_config import FinetuneConfig as FinetuneConfig
from ._hf import PublishedCheckpoint as PublishedCheckpoint
from ._loop import FitResult as FitResult
from ._loop import fit as fit
from ._loop import make_data_mesh as make_data_mesh
from ._metrics import EvalResult as EvalResult
from ._metrics import MetricsLog as MetricsLog
from ._metrics import accuracy as accuracy
from ._metrics import macro_f1 as macro_f1
from ._metrics import read_metrics as read_metrics
from ._model import LinearClassifier as LinearClassifier
from ._model import MLPClassifier as MLPClassifier
from ._model import make_model as make_model
from ._predicate import Predicate as Predicate
from ._predicate import parse_predicate as parse_predicate
from ._pretrain import PretrainConfig as PretrainConfig
from ._pretrain import PretrainResult as PretrainResult
from ._pretrain import build_model as build_model
from ._pretrain import pretrain as pretrain
from ._pretrain import pretrain_optimizer as pretrain_optimizer
from ._published import load_checkpoint as load_checkpoint
from ._step import evaluate as evaluate
from ._step import loss_fn as loss_fn
from ._step import make_train_step as make_train_step
from ._step import normalize_log1p as normalize_log1p
from ._step import predict as predict
from ._step import replicate as replicate
