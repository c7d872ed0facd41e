"""DSpark acceptance metrics as an ``evaluate`` module: accepted length, acceptance rate, position-wise acceptance.

    import evaluate
    from hf_dspark.evaluation import evaluate_module_path
    metric = evaluate.load(evaluate_module_path("dspark_acceptance"))
    metric.compute(verified=[7, 7, 3], accepted=[7, 2, 0], block_size=7)

One input row per speculative-decoding round: how many drafts the target verified and how many it accepted. The
definitions are the DSpark paper's (see ``hf_dspark.evaluation.metrics``): tau counts the target's own token.
"""

import datasets
import evaluate

from hf_dspark.evaluation import metrics

_DESCRIPTION = "Accepted length (tau, bonus token included), acceptance rate and position-wise conditional acceptance."
_KWARGS_DESCRIPTION = """
Args:
    verified (list of int): per round, the number of draft tokens the target verified.
    accepted (list of int): per round, the number of leading verified drafts it accepted (0 <= accepted <= verified).
    block_size (int, optional): number of positions for the position-wise curve (default: max(verified)).
Returns:
    accepted_length, acceptance_rate, position_acceptance (list, None where no round reached the position),
    position_reached (rounds that reached each position), rounds.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DsparkAcceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="DSpark: semi-autoregressive drafting with confidence-scheduled verification (DeepSeek, 2026)",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"verified": datasets.Value("int32"), "accepted": datasets.Value("int32")}),
        )

    def _compute(self, verified, accepted, block_size=None):
        block_size = block_size or max(verified, default=0)
        positions = metrics.position_acceptance(verified, accepted, block_size)
        return {"accepted_length": metrics.accepted_length(verified, accepted),
                "acceptance_rate": metrics.acceptance_rate(verified, accepted),
                "position_acceptance": positions["acceptance"], "position_reached": positions["reached"],
                "rounds": len(verified)}
