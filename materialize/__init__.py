"""materialize: the offline command that turns single-cell tables into omicsio_jax datasets."""

from ._materialize import MaterializeResult as MaterializeResult
from ._materialize import materialize as materialize
from ._synthetic import SyntheticCorpus as SyntheticCorpus
from ._synthetic import make_synthetic_corpus as make_synthetic_corpus
