"""DSpark confidence calibration as an ``evaluate`` module: ECE and ROC-AUC of the prefix survival per position.

    import evaluate
    from hf_dspark.evaluation import evaluate_module_path
    metric = evaluate.load(evaluate_module_path("dspark_calibration"))
    metric.compute(confidence_logits=[[2.0, 0.5], [-1.0, 0.3]], verified=[2, 2], accepted=[2, 0],
                   temperatures=[1.3, 0.9])

One input row per round that verified its whole block: the drafter's raw confidence logits z_1..z_g, the verified
and accepted counts. a_k = prod_{i<=k} sigmoid(z_i / T_i) is scored against the event "drafts 1..k accepted"
(rounds that verified position k). Optional ``thresholds`` adds the static-threshold sweep.
"""

import datasets
import evaluate

from hf_dspark.evaluation import metrics

_DESCRIPTION = "Per-position ECE / ROC-AUC of DSpark prefix-survival confidences (raw and with STS temperatures)."
_KWARGS_DESCRIPTION = """
Args:
    confidence_logits (list of list of float): per round, the raw confidence logits of positions 1..g.
    verified (list of int), accepted (list of int): per round, verified and accepted draft counts.
    temperatures (list of float, optional): STS temperatures; adds ``ece_calibrated``.
    num_bins (int, optional): equal-width ECE bins (default 15).
    thresholds (list of float, optional): also replay the static-threshold policy at these thresholds.
Returns:
    ece_raw, ece_calibrated, auc, num_samples (lists over positions) and, with thresholds, threshold_sweep.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DsparkCalibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="DSpark: semi-autoregressive drafting with confidence-scheduled verification (DeepSeek, 2026)",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "confidence_logits": datasets.Sequence(datasets.Value("float64")),
                "verified": datasets.Value("int32"),
                "accepted": datasets.Value("int32"),
            }),
        )

    def _compute(self, confidence_logits, verified, accepted, temperatures=None, num_bins=15, thresholds=None):
        out = metrics.calibration_metrics(confidence_logits, verified, accepted, temperatures, num_bins)
        if thresholds is not None:
            out["threshold_sweep"] = metrics.threshold_sweep(confidence_logits, verified, accepted, thresholds,
                                                             temperatures)
        return out
