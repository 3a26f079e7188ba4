"""Quantizing a model: recipes (tensor role -> format), calibration (imatrix, GPTQ, the calibration
text) and the converter that streams a source model into a .mxq file. This layer runs the model
(calibration generates and evaluates text), so it sits above the engine; the formats themselves
live in mixqrt.formats."""
