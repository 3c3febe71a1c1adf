"""Training and checkpoint writing for the small models of experiments/: `trainers` (losses, trainer loops,
drafter growth) and `synthetic` (HF-format target checkpoints from random or trained weights). The inference
package never imports this one."""
