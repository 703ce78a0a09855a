"""What every strategy does around a step, whatever its parallelisms: processes and the checks before launch, the
model's set-up, the step protocol (the order of a step, with the parts the parallelisms declare), collectives,
checkpoints, positions in the data and the loop, failures. The mixins of the shared base live here; nothing here
imports a parallelism or a preset."""
