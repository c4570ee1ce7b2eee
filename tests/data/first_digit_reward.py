"""A custom reward function for the dynamic-sampling tests: all or nothing on the answer's first
digit, so a young policy's prompt groups often agree (all 0), and DAPO's filter has work."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str[:1] == str(ground_truth)[:1]
    return {"score": float(right), "acc": right}
