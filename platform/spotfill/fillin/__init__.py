"""Fill-in: lend GPUs training cannot use to Ray Serve (and later Data/Tune), take them back first."""
