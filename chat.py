"""The model's own chat template, as token ids: what the policy is prompted with and what joins an
episode after each turn (docs/chat-models.md). loop.py names no model family: this reads the
end-of-turn token and the text around an observation from the template itself."""
from jinja2 import TemplateError


class Chat:
    """An episode is never re-templated: the prompt, the ids actually sampled, each observation as
    the template renders it; where the template is append-only, that is the rendering, exactly."""

    REPLY, OBSERVATION = "\x00REPLY\x00", "\x00OBSERVATION\x00"

    def __init__(self, tok, eos_ids=()):
        self.tok = tok
        if not tok.chat_template:
            raise ValueError(f"{tok.name_or_path} has no chat template: give an instruct model")
        self.specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
        self.fold_system = False
        try:
            self.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except TemplateError:  # Gemma 2: "System role not supported"
            self.fold_system = True
        self.eot_text, self.pre, self.post = self.turn_end()
        # a reasoning template (QwQ, DeepSeek-R1-Distill) may open the reply's <think> itself
        opened = self.post.rsplit("</think>", 1)[-1]
        self.reply_start = opened[opened.index("<think>"):] if "<think>" in opened else ""
        self.eot = tok.convert_tokens_to_ids(self.eot_text)
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        self.stop_ids = sorted({self.eot, tok.eos_token_id, *eos_ids} - {None})

    def render(self, messages):
        if self.fold_system and messages[0]["role"] == "system":
            system, user, *rest = messages
            user = dict(user, content=system["content"] + "\n\n" + user["content"])
            messages = [user, *rest]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def between_turns(self, observation):
        """The template's text from an assistant reply's end, via `observation`, to a generation."""
        probe = [{"role": "user", "content": "task"}, {"role": "assistant", "content": self.REPLY},
                 {"role": "user", "content": observation}]
        text = self.render(probe)
        return text[text.index(self.REPLY) + len(self.REPLY):]

    def turn_end(self):
        """The first special token the template writes after a reply (<|im_end|>, <|eot_id|>,
        <end_of_turn>, <|end|>, </s>), then the text before and after an observation."""
        after = self.between_turns(self.OBSERVATION)
        reply_end = after.split(self.OBSERVATION)[0]
        found = [(reply_end.find(s), s) for s in self.specials if s in reply_end]
        if not found:
            raise ValueError(f"the chat template of {self.tok.name_or_path} ends an assistant turn "
                             "with no special token, so a turn could never end: give an instruct "
                             "(chat) model")
        at, _, eot = min((at, -len(s), s) for at, s in found)  # the longer of two at one place
        pre, post = after[at + len(eot):].split(self.OBSERVATION)
        return eot, pre, post

    def encode(self, text, literal=False):
        """Template text keeps its special tokens; environment text (literal) cannot end a turn."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=literal)["input_ids"]

    def prompt(self, messages):
        return self.encode(self.render(messages))

    def observation(self, text):
        """As the template renders it (`trim` too), tokenized where it stands, after the turn's end:
        BPE merges the template's text around it (`[INST] `) with its first word."""
        after = self.between_turns(text)
        at = after.index(self.eot_text)
        rendered = after[at + len(self.eot_text) + len(self.pre):len(after) - len(self.post)]
        if not any(s in rendered for s in self.specials):
            return self.encode(after[at:])[1:]
        # text that spells a special token stays plain text, so that it cannot end a turn
        head = self.encode(self.eot_text + self.pre)[1:]
        return head + self.encode(rendered, literal=True) + self.encode(self.post)

    def truncate(self, text, max_tokens):
        # Tokenized a piece at a time up to the cut: BPE on a run without spaces is quadratic
        ids = []
        for start in range(0, len(text), 1000):
            ids += self.encode(text[start:start + 1000], literal=True)
            if len(ids) > max_tokens:
                break
        if len(ids) <= max_tokens:
            return text
        head = self.tok.decode(ids[:max_tokens])
        cut = max(head.rfind("\n"), head.rfind(" "))  # at a line or word boundary
        if cut > 0:
            head = head[:cut]
        note = f"{len(text)} characters, showing the first {max_tokens} tokens"
        return head + f"\n[output truncated: {note}]"
