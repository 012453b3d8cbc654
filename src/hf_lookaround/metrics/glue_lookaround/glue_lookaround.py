"""GLUE metrics as an `evaluate` module that loads offline.

The Hub's ``glue`` metric cannot be fetched without a network, so the package ships this one:

    >>> import evaluate
    >>> from hf_lookaround.evaluation.glue import glue_metric_path
    >>> metric = evaluate.load(glue_metric_path(), "mrpc")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.666..., 'f1': 0.666...}

Configurations: the GLUE tasks, plus ``accuracy`` and ``regression`` for any other
classification / regression data set.
"""

import datasets
import evaluate
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

_DESCRIPTION = """\
The metric of each GLUE task, as the GLUE benchmark defines it: Matthews correlation for CoLA,
Pearson and Spearman correlation for STS-B, accuracy and F1 (of the positive class) for MRPC
and QQP, accuracy for the others. ``accuracy`` and ``regression`` serve other data sets.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (ints), or scores (floats) for stsb / regression.
    references: gold labels (ints), or scores (floats) for stsb / regression.
Returns: a dict, depending on the configuration:
    cola: matthews_correlation; stsb, regression: pearson, spearmanr (and mse for regression);
    mrpc, qqp: accuracy, f1; the others: accuracy.
"""

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={ICLR},
  year={2019}
}
"""

ACCURACY_TASKS = ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "hans", "accuracy")
F1_TASKS = ("mrpc", "qqp")
REGRESSION_TASKS = ("stsb", "regression")
CONFIGS = ("cola",) + F1_TASKS + REGRESSION_TASKS + ACCURACY_TASKS


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class GlueLookaround(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise KeyError(f"unknown configuration {self.config_name!r}; choose one of {list(CONFIGS)}")
        dtype = "float32" if self.config_name in REGRESSION_TASKS else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}),
            reference_urls=["https://gluebenchmark.com/"],
            format="numpy",
        )

    def _compute(self, predictions, references):
        name = self.config_name
        if name == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if name in REGRESSION_TASKS:
            predictions, references = predictions.astype("float64"), references.astype("float64")
            result = {
                "pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0]),
            }
            if name == "regression":
                result["mse"] = float(((predictions - references) ** 2).mean())
            return result
        result = {"accuracy": float(accuracy_score(references, predictions))}
        if name in F1_TASKS:
            result["f1"] = float(f1_score(references, predictions))
        return result
