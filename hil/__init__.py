"""Hardware-in-the-loop rig: the same pytest tests against QEMU-emulated boards and real ones
(see hil/README.md)."""
