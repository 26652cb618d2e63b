"""DiLoCo (``parallel.sync_mode = "diloco"``): workers that take H inner steps alone, then one outer step together.

Modules: ``outer.py`` (:class:`DiLoCo`: DiLoCo and Streaming DiLoCo with the workers as rank groups of one job;
the int8 exchange) and ``elastic.py`` (:class:`~meshtrain.parallel.diloco.elastic.ElasticDiLoCo`: each worker
its own job, joined through torchft, free to leave and rejoin; ``diloco.lighthouse``).
"""

from meshtrain.parallel.diloco.outer import (INT8_BLOCK, DiLoCo, canonical_name, dequantize_int8, fragment_of,
                                             quantize_int8)

__all__ = ["INT8_BLOCK", "DiLoCo", "canonical_name", "dequantize_int8", "fragment_of", "quantize_int8"]
