"""What the ranks write, on its way: the relay over their pipes, lines and progress bars, in-order
records, the rank logs and metrics files."""
