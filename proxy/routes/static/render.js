// A model's answer as safe formatted text: fenced code blocks, bulleted and numbered lists, paragraphs,
// `inline code` and **bold**. Only DOM nodes are built (createElement, Text nodes): model output is
// untrusted and is never parsed as HTML, so "<img onerror=...>" in an answer shows as those characters.

function inline(parent, text) {
  // `code` first (its content is literal), then **bold** in what is left.
  const parts = text.split(/(`[^`\n]+`)/);
  for (const part of parts) {
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      const code = document.createElement("code");
      code.textContent = part.slice(1, -1);
      parent.append(code);
      continue;
    }
    const bolds = part.split(/(\*\*[^*\n]+\*\*)/);
    for (const piece of bolds) {
      if (piece.length > 4 && piece.startsWith("**") && piece.endsWith("**")) {
        const strong = document.createElement("strong");
        strong.textContent = piece.slice(2, -2);
        parent.append(strong);
      } else if (piece) {
        parent.append(document.createTextNode(piece));
      }
    }
  }
}

const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;

// The blocks of ``text``: an unterminated fence (an answer still streaming) is a code block to the end.
export function renderAnswer(target, text) {
  const blocks = [];
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence, when there is one
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (fence[1]) code.dataset.lang = fence[1];
      code.textContent = body.join("\n");
      pre.append(code);
      blocks.push(pre);
      continue;
    }
    const kind = BULLET.test(line) ? [BULLET, "ul"] : NUMBERED.test(line) ? [NUMBERED, "ol"] : null;
    if (kind) {
      const [pattern, tag] = kind;
      const list = document.createElement(tag);
      while (i < lines.length && pattern.test(lines[i])) {
        const item = document.createElement("li");
        inline(item, lines[i].match(pattern)[1]);
        list.append(item);
        i += 1;
      }
      blocks.push(list);
      continue;
    }
    if (!line.trim()) {
      i += 1; // a blank line ends a paragraph
      continue;
    }
    // A paragraph: this line (whatever it is: a "```" with more after it is text), and the lines after
    // it up to a blank line, a fence or a list.
    const para = [lines[i++]];
    while (i < lines.length && lines[i].trim() && !/^\s*```/.test(lines[i]) && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i])) {
      para.push(lines[i++]);
    }
    const p = document.createElement("p");
    inline(p, para.join("\n"));
    blocks.push(p);
  }
  target.replaceChildren(...blocks);
}
