"""What a launch will be, decided before any rank starts: its plan and payload, devices, XLA's
layout, the doctor's report, run directories and their leases."""
