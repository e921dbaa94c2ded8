"""DeepSpeed's reference numerics in numpy, the one source both sides are checked against.

  schedule.py    DeepSpeed's five LR schedules (and OneCycle momentum), step by step
  loss_scale.py  DeepSpeed's dynamic loss scaler (fp16): scale, skips, hysteresis
"""
