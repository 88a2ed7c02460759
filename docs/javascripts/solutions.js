// Exercise answers stay hidden until the reader opens them: every notebook cell tagged
// "solution" (collapsed in JupyterLab too) is folded into a <details> block on the site.
// nbval still executes and checks these cells; only their display is folded.
document.addEventListener("DOMContentLoaded", () => {
  for (const cell of document.querySelectorAll(".jp-Cell.celltag_solution")) {
    if (cell.closest("details.solution")) continue;
    const details = document.createElement("details");
    details.className = "solution";
    const summary = document.createElement("summary");
    summary.textContent = "Answer: code and output (checked by the test suite)";
    details.appendChild(summary);
    cell.parentNode.insertBefore(details, cell);
    details.appendChild(cell);
  }
});
